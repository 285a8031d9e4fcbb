"""Restoring a rollout snapshot: choosing one (`choice`, `selection`), verifying it
(`verification`), its plan and checks (`plan`), copying it (`copying`), restart
normalization through the ledger's public functions (`normalize`), doing it (`apply`),
and the run's store files (`run_files`). Imports `checkpoints`, `live`, `sqlite` and the
foundation."""
