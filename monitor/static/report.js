// The report page's script (monitor/report_page.py): draws each run's verdict, incident
// timeline and plots (uPlot) from the JSON in #report-data; on a live page, refetches it.
(function(){
const COLORS=["#1f77b4","#d62728","#2ca02c","#9467bd","#ff7f0e","#17becf","#8c564b","#e377c2","#7f7f7f","#bcbd22"];
function esc(s){return String(s).replace(/[&<>"']/g,c=>({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;","'":"&#39;"}[c]));}
function fmt(v){if(v===null||v===undefined)return "--";const a=Math.abs(v);return (a!==0&&(a<1e-3||a>=1e5))?v.toExponential(3):(+v.toPrecision(4)).toString();}
// The rules' constant thresholds as horizontal lines: dashed (red: page, amber: warning, blue: info)
// where an alert fires, dotted green where it clears, dotted grey for an "and" condition.
// Their labels, one per value, are elements over the plot (class th-label), laid out so
// that none overlaps another: each sits just above its line unless a neighbour is there,
// then it is pushed down (up, at the plot's bottom) just far enough to clear it; labels
// that cannot all fit in the plot's height are listed under the plot instead. A threshold that is a ratio to the
// series' own median is a series of its own (see "series" below), never a constant line.
const SEV_COLOR={page:"#c62828",critical:"#c62828",error:"#c62828",warning:"#d08700"};
const SEV_RANK={critical:4,page:3,error:3,warning:2,ticket:1,info:0};
// Most severe first: a label takes the style of its most severe line, drawn last (on top).
function bySeverity(ths){return ths.slice().sort((a,b)=>(SEV_RANK[b.severity]??0)-(SEV_RANK[a.severity]??0));}
function lineStyle(t,clear){return clear?["#2e7d32",[2,3]]:(t.condition?["#999",[2,4]]:[SEV_COLOR[t.severity]||"#3d6fb6",[8,4]]);}
function thresholdLabels(p){const byValue=new Map();
 const add=(v,text,style)=>{const k=String(v);if(!byValue.has(k))byValue.set(k,{value:v,texts:[],style:style});const e=byValue.get(k);if(!e.texts.includes(text))e.texts.push(text);};
 for(const t of bySeverity(p.thresholds)){const on=p.multi_metric?" "+t.metric:"";const only=t.only?` (${t.only} only)`:"";
  add(t.value,(t.condition?"and: ":"")+t.alert+on+" "+t.kind+" "+fmt(t.value)+only,lineStyle(t,false));
  if(t.clear!==null&&t.clear!==undefined)add(t.clear,t.alert+on+" clears at "+fmt(t.clear)+only,lineStyle(t,true));}
 return [...byValue.values()];}
function thresholdPlugin(p,fig){const labels=thresholdLabels(p);let box=null,list=null;
 return {hooks:{init:[u=>{box=document.createElement("div");box.className="th-labels";u.over.appendChild(box);
   list=document.createElement("div");list.className="th-list";fig.appendChild(list);}],
  draw:[u=>{const ctx=u.ctx,d=devicePixelRatio;ctx.save();ctx.lineWidth=1.5*d;
   for(const t of bySeverity(p.thresholds).reverse()){for(const clear of [false,true]){const v=clear?t.clear:t.value;if(v===null||v===undefined)continue;
    const y=u.valToPos(v,"y",true);if(!isFinite(y))continue;const [color,dash]=lineStyle(t,clear);
    ctx.strokeStyle=color;ctx.setLineDash(dash.map(x=>x*d));ctx.beginPath();ctx.moveTo(u.bbox.left,y);ctx.lineTo(u.bbox.left+u.bbox.width,y);ctx.stroke();}}
   ctx.restore();layout(u,box,list,labels);}]}};}
function labelEl(e){const el=document.createElement("div");el.className="th-label";el.style.borderLeftColor=e.style[0];el.textContent=e.texts.join("; ");el.dataset.value=String(e.value);return el;}
function layout(u,box,list,labels){box.textContent="";list.textContent="";if(!labels.length)return;
 const H=u.over.clientHeight,W=u.over.clientWidth,gap=1;
 const items=labels.map(e=>{const el=labelEl(e);el.style.maxWidth=Math.max(40,W-8)+"px";box.appendChild(el);
  return {el:el,h:el.offsetHeight,line:u.valToPos(e.value,"y")};}).filter(i=>isFinite(i.line)||(i.el.remove(),false));
 items.sort((a,b)=>a.line-b.line);
 // Each label's bottom just above its line; then top to bottom, push down what overlaps the one above.
 let prev=-Infinity;for(const i of items){i.y=Math.max(i.line-i.h-1,prev+gap,0);prev=i.y+i.h;}
 // What ran past the bottom goes back up, bottom to top.
 let next=H;for(let k=items.length-1;k>=0;k--){const i=items[k];i.y=Math.min(i.y,next-gap-i.h);next=i.y;}
 if(items.length&&items[0].y<0){box.textContent="";for(const e of labels)list.appendChild(labelEl(e));return;}
 for(const i of items){i.el.style.top=i.y+"px";}}
function timeline(v){const incs=v.incidents;if(!incs.length)return "";const lo=v.first_step??0,hi=Math.max(v.last_step??1,lo+1);
 let h='<div class="timeline" data-role="timeline">';for(const i of incs){const l=100*(i.first_step-lo)/(hi-lo),w=Math.max(0.5,100*(i.last_step-i.first_step)/(hi-lo));
 h+=`<div class="tl-row"><div class="tl-bar ${esc(i.severity)}" style="left:${l}%;width:${w}%" title="${esc(i.alert)} steps ${i.first_step}-${i.last_step}">${esc(i.alert)} ${esc(Object.values(i.labels).join(","))}</div></div>`;}
 return h+`</div><div class="tl-axis"><span>step ${lo}</span><span>step ${hi}</span></div>`;}
function headline(v){const n=v.incidents.length;const steps=v.first_step===null?"no steps":`steps ${v.first_step}-${v.last_step}`;
 if(!n)return [`ok`,`No incident in ${v.reports} reports (${steps}).`];const pages=v.incidents.filter(i=>i.severity==="page").length;
 const cls=pages?"page":(v.incidents.some(i=>i.severity==="warning")?"warning":"info");
 return [cls,`${n} incident(s)${pages?`, ${pages} of severity page`:""} in ${v.reports} reports (${steps}).`];}
function table(v){if(!v.incidents.length)return "";let h='<table class="incidents"><tr><th>alert</th><th>severity</th><th>series</th><th>first step</th><th>last step</th><th>peak</th><th>state</th><th>what to do</th></tr>';
 for(const i of v.incidents){h+=`<tr class="incident" data-alert="${esc(i.alert)}"><td>${esc(i.alert)}</td><td class="sev-${esc(i.severity)}">${esc(i.severity)}</td><td>${esc(Object.entries(i.labels).map(([k,x])=>k+"="+x).join(", ")||"-")}</td><td>${i.first_step}</td><td>${i.last_step}</td><td>${fmt(i.peak)}</td><td>${i.resolved?"resolved":"firing"}</td><td>${esc(i.action)}<div class="note">${esc(i.summary)}</div></td></tr>`;}
 return h+"</table>";}
function coverage(v){const sig=v.signals||{};const names=Object.keys(sig);
 if(names.length)return '<p class="coverage" data-role="coverage">Watched: '+names.map(n=>{const s=sig[n];
  return s.active?`${esc(n)} (active in ${s.active} of ${s.reports} reports)`:`<b>${esc(n)}: ${esc(s.reason)}</b> (${esc(s.detail)})`;}).join("; ")+"</p>";
 const c=v.coverage||{};const groups=["optimizer","loss","params","adam","softmax"];
 return '<p class="coverage" data-role="coverage">Watched: '+groups.map(n=>c[n]?`${n} (${c[n]} of ${v.reports} reports)`:`${n}: no figures`).join("; ")+"</p>";}
function draw(root,data){root.innerHTML="";const width=Math.floor(Math.min(640,Math.max(320,((root.clientWidth||1100)-120)/2)));
 for(const [ri,r] of data.runs.entries()){const v=r.verdict;const [cls,text]=headline(v);const sec=document.createElement("section");sec.className="run";sec.dataset.run=v.run;sec.id="run-"+ri;
  sec.innerHTML=`<h2>Run ${esc(v.run)}</h2><div class="verdict ${cls}" data-role="verdict">${esc(text)}${v.ended?"":" The run has not closed its monitor."}</div>${table(v)}${timeline(v)}${coverage(v)}<div class="plots"></div>`;
  root.appendChild(sec);const plots=sec.querySelector(".plots");
  for(const p of r.panels){const fig=document.createElement("figure");fig.className="plot";fig.dataset.panel=p.key;fig.style.width=(width+14)+"px";
   fig.innerHTML=`<figcaption>${esc(p.title)}${p.left_out?` <span class="note">(${p.left_out} more series not drawn: the most extreme are shown)</span>`:""}</figcaption>`
    +(p.notes||[]).map(n=>`<div class="note th-note">${esc(n)}</div>`).join("");plots.appendChild(fig);
   // A threshold that moves with the series (a ratio to its own median) is a series: dashed
   // in the alert's colour where it fires, dotted green where it clears, in the legend by name.
   let ci=0;const series=[{label:"step"}].concat(p.series.map(s=>{const th=s.threshold;
    const [color,dash]=th?lineStyle({severity:th.severity},th.kind==="clear"):[COLORS[ci++%COLORS.length],undefined];
    return {label:s.label,stroke:color,dash:dash,width:s.incident?2.5:(th?1.5:1.2),spanGaps:true,points:{show:false},value:(u,x)=>fmt(x)};}));
   const ys=p.thresholds.flatMap(t=>t.clear===null||t.clear===undefined?[t.value]:[t.value,t.clear]);
   const opts={width:width,height:240,series:series,plugins:[thresholdPlugin(p,fig)],
    scales:{x:{time:false},y:{range:(u,mn,mx)=>{let a=Math.min(mn,...ys),b=Math.max(mx,...ys);if(!isFinite(a)||!isFinite(b)){a=0;b=1;}const pad=(b-a)*0.08||1;return [a-pad,b+pad];}}},
    axes:[{label:"step"},{size:60,values:(u,vals)=>vals.map(fmt)}],legend:{live:true}};
   new uPlot(opts,[p.x].concat(p.series.map(s=>s.values)),fig);}}}
window.trainvitalsDraw=draw;
const root=document.getElementById("runs");const data=JSON.parse(document.getElementById("report-data").textContent);draw(root,data);
const live=document.body.dataset.live;if(live){let last=data.generated;setInterval(()=>{fetch(live,{cache:"no-store",credentials:"same-origin"}).then(r=>r.ok?r.json():null).then(d=>{if(d){draw(root,d);last=d.generated;document.getElementById("updated").textContent="updated "+new Date(d.generated*1000).toLocaleTimeString();}}).catch(()=>{});},2000);}
})();
