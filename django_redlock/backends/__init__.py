"""Lock services besides Redlock, behind the interface Redlock has (see :mod:`.base`).

``REDLOCK["BACKENDS"]`` names them by alias; :func:`django_redlock.get_locks` returns one.
Nothing here imports Django, kazoo or a database driver until a backend module is imported.
"""
