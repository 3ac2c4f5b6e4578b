"""OpenAI Realtime API sessions (/v1/realtime): per-session state in the API process."""
