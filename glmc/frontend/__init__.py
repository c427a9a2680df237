"""Frontend: the public API, the command line and workload loading."""
