"""Generation engines and prefix capture: the GenerationEngine protocol, the tiny
embedded policy, and the CPU reference engine."""

from .protocol import GenerationEngine, GenerationRequest, GenerationResult, SamplingParams, generate_all
from .reference_engine import ReferenceEngine
from .tiny_policy import build_tiny_policy, encode_strict, load_policy

__all__ = [
    "GenerationEngine",
    "GenerationRequest",
    "GenerationResult",
    "ReferenceEngine",
    "SamplingParams",
    "build_tiny_policy",
    "encode_strict",
    "generate_all",
    "load_policy",
]
