"""The cost model: each op's time on each device, each copy's time on each link."""
