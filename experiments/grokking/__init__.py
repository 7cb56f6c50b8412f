"""The grokking study: its code (``study.py``), data (``data.py``), configs, run scripts, README and records."""
