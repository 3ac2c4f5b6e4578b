"""Stress runs of the real speech pipeline (abort storm, soak): scripts and the logic their CI tests share."""
