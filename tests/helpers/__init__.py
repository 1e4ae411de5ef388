"""What tests share: tiny models (`models`), cores run to the end (`cores`; serving `refine`:
`refine`; with EAGLE heads: `eagle`; with MASK-slot adapters: `adapters`; split over ranks:
`parallel`), live servers (`servers`), metric samples (`metrics`), structured-output schemas
(`schemas`), the deployment files (`deploy`) and what a PNG starts with (`png`). Tests import
these, never each other."""
