"""`python -m tools.campaign`: the nightly-size crash, failover and fuzz campaign (tools/campaign/nightly.py)."""

from tools.campaign.nightly import main

raise SystemExit(main())
