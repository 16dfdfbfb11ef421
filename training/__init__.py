"""Fine-tuning: task data in the chat format, the loss of eq. 5, the training loop with resumable
snapshots, self-distillation on the model's own answers, cached frozen states, evaluation."""
