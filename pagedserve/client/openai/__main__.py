"""`python -m pagedserve.client.openai`: serve the OpenAI-compatible shim."""

from pagedserve.client.openai.main import main

raise SystemExit(main())
