"""The OpenAI-compatible server (`smcspec serve`)."""
