"""Offline tools over trained models: conversion between Hugging Face safetensors and megatron-core dist
checkpoints at any TP/PP/EP layout (convert, its command line convert_cli), and a run's trained model as a Hugging
Face directory (export). Above checkpoint (it reads and writes the formats checkpoint/ defines)."""
