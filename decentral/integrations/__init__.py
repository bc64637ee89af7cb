"""Adopt a protocol from a framework's own training loop with one callback (optional extras):

    decentral.integrations.hf_trainer.DecentralCallback   transformers.Trainer   pip install 'decentral[hf]'
    decentral.integrations.lightning.DecentralCallback    lightning.pytorch      pip install 'decentral[lightning]'

This package imports neither framework: each of those modules imports its own when it is imported.
"""
