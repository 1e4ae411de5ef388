"""What tests share: tiny models (`models`), cores run to the end (`cores`), live servers
(`servers`), metric samples (`metrics`) and the deployment files (`deploy`)."""
