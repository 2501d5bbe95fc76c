"""Stateless building blocks shared by the model families. Shapes are in the names: B batch, L query
length, S key length, D model width, H query heads, K kv heads, G = H/K, Dh head width, F mlp width."""
