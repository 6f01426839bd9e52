"""Offline tools over trained models: conversion between Hugging Face safetensors and megatron-core dist
checkpoints at any TP/PP/EP layout (convert: the entry points the calling process runs, checks: its input
checks; worker, to_mcore, to_hf, verify: what its worker processes run; convert_cli: its command line), and a
run's trained model as a Hugging Face directory (export). Above checkpoint (it reads and writes the formats
checkpoint/ defines)."""
