"""Tiered memory: page pools on device, host and disk; chunks; asynchronous movement; accounting."""

from tiertrain.plan.budgets import Budgets
from tiertrain.memory.chunk import Chunk
from tiertrain.memory.layout import ChunkLayout, search_chunk_size
from tiertrain.memory.movement import Handle
from tiertrain.memory.system import MemorySystem
from tiertrain.plan.tiers import Kind, Tier

__all__ = ["Budgets", "Chunk", "ChunkLayout", "Handle", "Kind", "MemorySystem", "Tier", "search_chunk_size"]
