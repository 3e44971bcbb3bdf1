"""KV connectors: move KV blocks between engines (disaggregated prefill, external KV stores)."""

from sparrow.kv_transfer.base import KVConnectorBase, KVConnectorRole, build_connector

__all__ = ["KVConnectorBase", "KVConnectorRole", "build_connector"]
