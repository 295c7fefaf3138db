"""The upstream pin: upstream.lock, pinning a release, the content-addressed artifact cache, pristine trees."""
