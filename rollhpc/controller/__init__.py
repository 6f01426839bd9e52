"""Rank 0: the pipeline and the proxies through which it calls the worker groups."""
