"""Conversations (DESIGN §8, §10): ask and reply, tasks, channels, history and search."""
