"""bertpipe's Apache Beam pipelines (see job.py for the skeleton they share)."""

import logging

from beam_jobs.beam_import import import_beam

# Beam's GCP IO warns about a missing optional client at import time; it says nothing to a user.
logging.getLogger().addFilter(lambda record: "apitools not found" not in record.getMessage())
import_beam()
