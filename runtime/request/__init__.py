"""The request path: an artifact loaded on an engine (loader), a request checked into decode settings (checks,
settings), the decode loop and the drafter protocol it calls (decode, drafter), the library and API over them
(frontend, api), batching, streamed text and the run's trace."""
