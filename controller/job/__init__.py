"""The main job, assembled: `build` turns a config into parts (the only place backends are
chosen by name: reference engine or vLLM, local or Ray or agent-server environments) and
`controller` runs the pumps on their threads. The top floor: it may import every other
floor, and nothing in the controller imports it."""
