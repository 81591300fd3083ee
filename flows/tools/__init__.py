"""Tools beside the flows: sample data, infra rendering and the deployments ``bertpipe serve`` runs."""
