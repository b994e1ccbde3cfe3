"""Flower App for bench/fl.py (digits, MLP, FedAvg)."""
