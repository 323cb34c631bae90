"""Single-device model code: config, ops with naive references, the model. No torch.distributed here."""
