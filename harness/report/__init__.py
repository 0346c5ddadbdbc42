"""The report: repros, the block-table picture, what a campaign exercised, progress lines."""
