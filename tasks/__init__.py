"""The TL;DR and red-teaming tasks (rewards.py holds the Task interface and GSM8K)."""
