"""A stand-in for vLLM in the server-mode tests (tests/test_server_mode.py): no GPU, no model."""
__version__ = "0.22.1"
