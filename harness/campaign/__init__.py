"""The campaign: what a run is told, its runner and search, jobs, journal and example database."""
