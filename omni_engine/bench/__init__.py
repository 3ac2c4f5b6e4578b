"""``omni-engine bench serve``: a benchmark client for any OpenAI-compatible server, text and audio.

``datasets`` (what is asked), ``backends`` (one request per API, timed as it streams), ``playback``
(a listener at 1x: time to first audio, underruns), ``results`` (vLLM's figures plus audio's),
``serve_bench`` (arrivals, concurrency, the command).
"""
