"""The UCX backend (ucxx): `transport` is the Transport, `waits` awaits ucxx without
spinning, `fixes` patches ucxx bugs it would hit. Importing this package loads nothing,
so `shared.transport` never pays for ucxx until a UCX transport is made."""
