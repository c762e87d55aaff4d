"""Typed clients, one module per service: the only way one service calls another."""
