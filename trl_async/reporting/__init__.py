"""What a run shows and leaves behind: the progress bar and summary (``progress.py``) and the audit trail of what
was trained on (``trajectories.py``)."""
