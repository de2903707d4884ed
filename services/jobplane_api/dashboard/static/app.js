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
    // Not while the tab is hidden, a form in it has focus, or rows are selected (checked
    // again when the answer arrives: the user may have started meanwhile).
    function busy() {
      return document.hidden || region.querySelector("form :focus, input[type=checkbox]:checked");
    }
    function tick() {
      if (busy()) {
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
        if (busy()) {
          schedule();
          return;
        }
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

  // <form data-confirm="…">: asks before submitting. <form data-confirm-selected="{action}
  // {n} …">: a bulk action on the checkboxes that belong to it (form="id"), with their count.
  document.addEventListener("submit", function (event) {
    var form = event.target;
    var message = form.getAttribute("data-confirm");
    if (message && !window.confirm(message)) event.preventDefault();
    var selected = form.getAttribute("data-confirm-selected");
    if (!selected) return;
    // (form.id would be the checkboxes named "id": a form's named elements shadow it)
    var n = document.querySelectorAll('input[form="' + form.getAttribute("id") + '"]:checked').length;
    var verb = event.submitter ? event.submitter.getAttribute("data-verb") : "Act on";
    if (n === 0) {
      window.alert("Select instances first.");
      event.preventDefault();
    } else if (!window.confirm(selected.replace("{action}", verb).replace("{n}", n))) {
      event.preventDefault();
    }
  });

  // <input data-select-all="form-id">: checks or clears every checkbox of that form.
  document.addEventListener("change", function (event) {
    var form = event.target.getAttribute("data-select-all");
    if (!form) return;
    document.querySelectorAll('input[form="' + form + '"]').forEach(function (box) {
      box.checked = event.target.checked;
    });
  });

  document.addEventListener("DOMContentLoaded", function () {
    localise(document);
    document.querySelectorAll("[data-live]").forEach(live);
  });
})();
