"""The trace: event definitions (`events`), the writer, the named queries and the DuckDB
analysis. Imports only `sqlite` and the foundation."""
