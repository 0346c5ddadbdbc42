"""A tiny kernel package, as a user's repository would hold one."""
