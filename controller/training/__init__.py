"""The train side: the train pump (`pump`) waits for the groups stamped for a step, trains
(`grpo`, laying batches out with `packing`), refits the engine and publishes trainer
checkpoints (`checkpoints`). It reads finished groups from the store and never touches an
episode in flight."""
