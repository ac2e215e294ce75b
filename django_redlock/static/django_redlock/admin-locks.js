// django_redlock admin pages: live countdowns, relative times, select-all and auto-refresh.
// No inline script is used, so the pages work under a strict Content-Security-Policy.
"use strict";
(function () {
    // Same format as django_redlock.admin_views.format_duration.
    function formatDuration(seconds) {
        seconds = Math.max(seconds, 0);
        if (seconds < 1) { return Math.round(seconds * 1000) + " ms"; }
        if (seconds < 10) { return seconds.toFixed(1) + " s"; }
        const whole = Math.floor(seconds);
        if (whole < 60) { return whole + " s"; }
        if (whole < 3600) { return Math.floor(whole / 60) + " min " + (whole % 60) + " s"; }
        if (whole < 86400) {
            return Math.floor(whole / 3600) + " h " + Math.floor((whole % 3600) / 60) + " min";
        }
        return Math.floor(whole / 86400) + " d " + Math.floor((whole % 86400) / 3600) + " h";
    }

    const loaded = performance.now();

    function tick() {
        const elapsed = (performance.now() - loaded) / 1000;
        document.querySelectorAll("[data-countdown]").forEach(function (el) {
            const left = parseFloat(el.dataset.countdown) - elapsed;
            if (left <= 0) {
                el.textContent = "expired";
                el.classList.add("redlock-expired");
            } else {
                el.textContent = formatDuration(left);
            }
        });
        document.querySelectorAll("[data-countup]").forEach(function (el) {
            el.textContent = formatDuration(parseFloat(el.dataset.countup) + elapsed);
        });
    }

    function selected() {
        return document.querySelectorAll("input.redlock-select:checked").length > 0;
    }

    function setUp() {
        setInterval(tick, 1000);

        const all = document.getElementById("redlock-select-all");
        if (all) {
            all.addEventListener("change", function () {
                document.querySelectorAll("input.redlock-select").forEach(function (box) {
                    box.checked = all.checked;
                });
            });
        }

        const refresh = document.getElementById("redlock-autorefresh");
        if (refresh) {
            const storageKey = "django_redlock.autorefresh";
            const interval = (parseFloat(refresh.dataset.interval) || 5) * 1000;
            let timer = null;
            const arm = function () {
                clearTimeout(timer);
                if (!refresh.checked) { return; }
                timer = setTimeout(function () {
                    // Never throw away a selection the operator is making.
                    if (selected()) { arm(); } else { window.location.reload(); }
                }, interval);
            };
            try { refresh.checked = localStorage.getItem(storageKey) === "1"; } catch (e) { }
            refresh.addEventListener("change", function () {
                try { localStorage.setItem(storageKey, refresh.checked ? "1" : "0"); } catch (e) { }
                arm();
            });
            arm();
        }
    }

    if (document.readyState === "loading") {
        document.addEventListener("DOMContentLoaded", setUp);
    } else {
        setUp();
    }
})();
