"""The compiler: pass manager and its instruments, lowerings shared by passes and backends."""
