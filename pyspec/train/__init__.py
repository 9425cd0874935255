"""Drafter training (``pyspec train-draft``) and evaluation (``pyspec eval-draft``)."""
