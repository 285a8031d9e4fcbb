"""SQLite underneath everything: the engine and the one transaction helper (`database`),
read-only opening with the authorizer (`readonly`), the one integrity check (`integrity`),
Alembic revisions of the store and the trace (`revision`), upgrading a file through a
copy (`upgrade`), what a file is (`identity`) and who has it open (`inuse`).
Imports only the store's foundation modules (errors, faults, fsio)."""
