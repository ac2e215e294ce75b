"""``{{ seconds|duration }}``: a duration on the admin pages, as their countdown script writes
it (:func:`django_redlock.admin_views.format_duration`)."""

from django import template

from ..admin_views import format_duration

register = template.Library()
register.filter("duration", format_duration)
