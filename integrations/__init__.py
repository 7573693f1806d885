"""Integrations of linear_mha into full models (users of the core library, never imported by it)."""
