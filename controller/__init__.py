"""rolloutdb.controller: the main job (pumps, snapshots, resume) on top of `rolloutdb.store`.

Importing any part of it registers the controller's kill points with the store's fault
registry (`fault_points`), so every module that calls `faults.point(...)` finds its
points registered without importing them itself."""

from rolloutdb.controller import fault_points  # noqa: F401 - registration is the import's effect
