"""The Model Registry: the registered pyfunc model (it loads the trainer's model with the LoRA), registering a
LoRA as a model version, and the promotion gate. Above the trainer and tracking, so neither imports it."""
