"""Parallel execution of the DiT: process groups, collectives, tensor-parallel layers, Ulysses."""
