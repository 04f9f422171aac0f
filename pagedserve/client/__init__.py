"""Client side: the pagedserve CLI, the launcher, the OpenAI-compatible shim."""
