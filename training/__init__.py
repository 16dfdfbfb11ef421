"""Fine-tuning and the build: task data in the chat format, the loss of eq. 5, the training loop with resumable
snapshots, self-distillation on the model's own answers, cached frozen states, evaluation, and the build's
trained stages (stage.py: key, inputs, run, output; stages.py: each one; pipeline.py: the rest of the build)."""
