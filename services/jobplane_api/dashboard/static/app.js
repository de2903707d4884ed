// Jobplane dashboard: live regions, local times, confirmations. No framework, no CDN.
(function () {
  "use strict";

  // <time data-local datetime="…">: show the viewer's local time on hover, and a local
  // date in elements marked data-local="full".
  function localise(root) {
    root.querySelectorAll("time[data-local]").forEach(function (el) {
      var when = new Date(el.getAttribute("datetime"));
      if (isNaN(when)) return;
      var local = when.toLocaleString(undefined, {
        year: "numeric", month: "short", day: "numeric",
        hour: "2-digit", minute: "2-digit", second: "2-digit", timeZoneName: "short"
      });
      if (el.getAttribute("data-local") === "full") el.textContent = local;
      el.title = local + " (your time) · " + el.title;
    });
  }

  // [data-live="/url"]: replaced every data-every ms by the server-rendered fragment at
  // that URL while the tab is visible. The fragment is escaped by the server's templates.
  function live(region) {
    var every = parseInt(region.getAttribute("data-every") || "3000", 10);
    var timer = null;
    function tick() {
      if (document.hidden || region.contains(document.activeElement) && region.querySelector("form :focus")) {
        schedule();
        return;
      }
      fetch(region.getAttribute("data-live"), {
        headers: { "X-Live": "1" }, credentials: "same-origin", cache: "no-store"
      }).then(function (response) {
        if (response.status === 401) {
          document.getElementById("offline").hidden = false;
          return null;
        }
        return response.ok ? response.text() : "";
      }).then(function (html) {
        if (html === null) return;
        if (html) {
          region.innerHTML = html;
          localise(region);
        }
        var stop = region.querySelector("[data-live-stop]");
        if (!stop) schedule();
      }).catch(schedule);
    }
    function schedule() { clearTimeout(timer); timer = setTimeout(tick, every); }
    if (!region.querySelector("[data-live-stop]")) schedule();
  }

  // <form data-confirm="…">: asks before submitting.
  document.addEventListener("submit", function (event) {
    var message = event.target.getAttribute("data-confirm");
    if (message && !window.confirm(message)) event.preventDefault();
  });

  document.addEventListener("DOMContentLoaded", function () {
    localise(document);
    document.querySelectorAll("[data-live]").forEach(live);
  });
})();
