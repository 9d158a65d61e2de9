"""kv-slot-tracker: active-sequence slot tracker for KV-aware LLM routing."""

__version__ = "0.1.0"
