"""What is learned: the embedded digits task (`digits`), prompt files (`datasets`), a
user's own rewards, environments and trainers by import path (`plugins`), their failures
shown as theirs (`user_code`), and the one registry of task kinds (`registry`).

Pure data and user code: no pump, no store transaction. The rollout pump, the agent
servers and the Ray environment workers all build a task through `registry.build_task`,
so a task kind is known in one place."""
