"""The live store: schema, the `Store` class, ledger and pool transitions, the named reads
the pumps need (`queries`), invariants, payload codec and capture into a snapshot file.
Imports `sqlite` and the foundation."""
