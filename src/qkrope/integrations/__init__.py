"""Framework integrations (imported on demand: ``import qkrope.integrations.transformers``)."""
